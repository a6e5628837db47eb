"""The ranks' entry point, as the experiment guide runs it:

    torchrun --nproc_per_node=4 -m labkit.train --method {ddp,allreduce,ps} [flags]

A thin shim (the guide's command is a contract): the rank's work is labkit.training.rank.
"""
if __name__ == "__main__":
    # torchrun stops the other ranks with SIGTERM when one fails, often while they block in a
    # C++ collective where a Python handler could not run: a dedicated thread takes SIGTERM,
    # rank 0 marks its result file, and the rank dies of SIGTERM at once
    # (labkit.training.lifecycle). First thing, before torch is imported: the threads numpy
    # and torch start at import must inherit the blocked signal.
    from labkit.training import lifecycle

    lifecycle.take_sigterm()
    from labkit.training.rank import main

    lifecycle.leave(main())
