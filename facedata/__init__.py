"""Face data for pairface: RecordIO without mxnet, V-view datasets, loaders, packing, synthetic faces.

``dataset.py`` names what train.py and the tools use; tests and benchmarks import the modules here.
"""
