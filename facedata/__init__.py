"""Face data for pairface: RecordIO without mxnet, V-view datasets, loaders, packing, synthetic faces.

``dataset.py`` re-exports the public names: import them from there.
"""
