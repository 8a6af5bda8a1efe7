"""farlink: train one language model across islands of compute joined by slow links.

Data flows one way: ``data`` -> ``train`` (inner steps) -> ``sync`` (outer step through ``comm``,
with ``codecs`` and ``robust`` aggregation) -> ``train``. An algorithm never imports a backend;
a backend never knows the model.
"""

__version__ = "0.1.0"
