"""What a step is measured with, attached to the loop (labkit.training.trainer) as named
components: the step's parts and honest timers (timers), an epoch's figures (meter), FLOPs and
MFU (flops), and the exactness reference (exactness).
"""
