"""Clusters of processes.

``tf_config``: ``TF_CONFIG`` parsing and checks per strategy, the chief, ports (no
TensorFlow). ``local_job``: a whole cluster started on this machine (``launch_local.py``).
"""
