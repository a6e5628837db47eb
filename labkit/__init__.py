"""labkit: measure what data-parallel training really costs (DDP, all-reduce, parameter server)."""
__version__ = "0.1.0"
