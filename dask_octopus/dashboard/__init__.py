"""What the plugin shows where Dask users look: the ``/octopus`` page on the scheduler's dashboard and
``dask_octopus_*`` series on distributed's Prometheus endpoint ``/metrics``.

- ``records.py``: pure, bounded records the scheduler plugin keeps (how the weights moved, how each
  recent plan's latest run finished on each worker);
- ``snapshot.py``: one consistent read of the scheduler plugin, which the page and the metrics share;
- ``columns.py``: a snapshot as the columns the page draws (pure);
- ``page.py``: the page, a Bokeh standalone document (needs ``bokeh``);
- ``metrics.py``: the Prometheus collector (needs ``prometheus_client``);
- ``serve.py``: the Tornado routes on the scheduler's HTTP server and the collector's registration,
  each turned off with one log line when its optional dependency is missing.

Only ``records.py`` is imported with ``dask_octopus``; the rest when the scheduler plugin starts.
"""
