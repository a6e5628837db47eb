"""The ranks' entry point, as the experiment guide runs it:

    torchrun --nproc_per_node=4 -m labkit.train --method {ddp,allreduce,ps} [flags]

A thin shim (the guide's command is a contract): the rank's work is labkit.training.rank, its
life (SIGTERM, errors, exit) labkit.training.lifecycle.start_rank.
"""
if __name__ == "__main__":
    from .training.lifecycle import start_rank

    start_rank("labkit.training.rank")
