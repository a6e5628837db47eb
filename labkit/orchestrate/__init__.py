"""The lab's commands that run things: experiment, sweep (here or on Slurm), bench, check,
reproduce and continue, and papermill and nbconvert (kernels, render, export).
"""
