"""Face data for pairface, the implementation behind ``dataset.py``: RecordIO without mxnet, V-view datasets,
loaders, packing, synthetic faces.

Outside this package, import what ``dataset.py`` exports from there (one path per name); only a test or
benchmark of one module here imports that module's other names.
"""
