"""The launcher's start-up folder: `megatron-rl-patches run` puts this folder first on the
child's PYTHONPATH, so Python imports the `sitecustomize` module in it at start-up. It works in
any install (a wheel, an editable install, a read-only site-packages) and needs no file written."""
