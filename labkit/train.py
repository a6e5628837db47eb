"""The ranks' entry point, as the experiment guide runs it:

    torchrun --nproc_per_node=4 -m labkit.train --method {ddp,allreduce,ps} [flags]

A thin shim (the guide's command is a contract): the rank's work is labkit.training.rank.main,
its life (SIGTERM, errors, exit) labkit.training.lifecycle's.
"""
if __name__ == "__main__":
    from .training import lifecycle

    lifecycle.begin_rank()  # SIGTERM taken before torch is imported: its threads inherit that
    from .training.rank import main  # imports torch

    lifecycle.leave(main())
