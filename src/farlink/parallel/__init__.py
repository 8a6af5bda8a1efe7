"""Model parallel across peers: a GPT split into pipeline stages served by swarms of peers.

- :mod:`~farlink.parallel.stages`: which blocks each stage holds, and the stage module itself;
- :mod:`~farlink.parallel.wire`: framed messages of (compressed) activations over TCP;
- :mod:`~farlink.parallel.stage_server`: one peer serving one stage (forward, backward, step);
- :mod:`~farlink.parallel.swarm_router`: which peer of a stage gets the next micro-batch;
- :mod:`~farlink.parallel.pipeline`: the trainer that schedules micro-batches through stages;
- :mod:`~farlink.parallel.placement`: peers to (pipeline, stage) from a measured link matrix.
"""
