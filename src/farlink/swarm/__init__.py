"""The swarm application: ``farlink swarm start | join`` (:mod:`~farlink.swarm.command`) and the
run definition a bootstrap peer serves to volunteers (:mod:`~farlink.swarm.definition`). The
DHT shard claims they use are the library's (:mod:`farlink.comm.swarm_shards`)."""
