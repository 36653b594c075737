"""Strategy plug-ins (one module each), devices and cluster launch.

The registry of strategies by name is :mod:`tfpar.parallel.registry`; this package
imports nothing itself, so the cluster launcher (``tfpar.parallel.cluster``) starts
without loading TensorFlow.
"""
