"""The bench (`labkit bench`): where a step's time goes per method, against DDP and a plain
PyTorch loop. The rank side (bench_rank, plain_loop, pricing) and the bench document as the
report and the cost model read it (bench_view, instrument_cost); the command is
labkit.orchestrate.bench.
"""
