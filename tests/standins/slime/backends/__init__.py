"""Test stand-in for the slime package: only the module layout the patches target
(tests put tests/standins on sys.path)."""
