"""Pipeline model parallelism (``--strategy pipeline``).

``stages``: the ``--stages`` language, the default placement and the stages it makes.
``plugin``: the GPipe plug-in that runs them, micro-batched.
"""
