"""tfpar: data-, tower-, cluster- and pipeline-parallel RNN language models.

    import tfpar

    metrics = tfpar.train(tfpar.make_config(strategy="mirrored", max_steps=100))

``make_config``, ``train`` and ``Config`` (:mod:`tfpar.api`) are imported on first use:
``import tfpar`` imports no TensorFlow, so a command can install its console filter
(:mod:`tfpar.tools.console`) before TensorFlow starts.
"""

__all__ = ["Config", "make_config", "train"]


def __getattr__(name):
    if name in __all__:
        from tfpar import api

        return getattr(api, name)
    raise AttributeError(f"module 'tfpar' has no attribute {name!r}")
