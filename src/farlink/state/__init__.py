"""A run's state on disk, for the library and the application alike: atomic files
(:mod:`~farlink.state.files`), verified checkpoints (:mod:`~farlink.state.checkpoint`) and the
background thread that writes them while training goes on (:mod:`~farlink.state.background`).
Nothing here knows a run's config: callers hand in paths, tensors and meta."""
