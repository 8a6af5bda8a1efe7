"""Trust for runs whose peers cannot all be trusted.

``auth``/``keys``: who may join and who sent a message; ``validate``: is an update sane;
``aggregators``: combine updates so a minority of bad ones cannot steer the model; ``attacks``:
emulated bad peers for benchmarks; ``ledger``: who contributed what.
"""
