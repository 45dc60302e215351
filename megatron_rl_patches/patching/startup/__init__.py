"""Start-up in one home: everything that makes patches apply in a process that imports nothing
of ours. `hook` is what every route runs; `files` the .pth/.start texts (the wheel's copies are
generated from them by setup.py) and the `startup install|remove` of editable installs;
`launcher` the environment of `megatron-rl-patches run`; `shim/sitecustomize.py` the file that
environment puts first on PYTHONPATH. Imported at interpreter start-up: imports nothing here.
"""
