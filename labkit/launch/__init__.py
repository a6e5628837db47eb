"""The launcher: one method's torchrun job on this machine (launch), on an emulated cluster
(emulated, cluster, cluster_node), its parameters and what its output and failures say.
"""
