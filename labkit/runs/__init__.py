"""Run folders once written: the environment record, new folders under runs/, the runs index,
the explorer, diff and the comparison of a run with its reproduction, and the commands that
only read (`labkit report`, `labkit runs`, `labkit diff`).
"""
