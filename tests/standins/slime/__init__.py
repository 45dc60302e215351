"""Test stand-in for the slime package, the only one: the modules and signatures the patches
target (tests put tests/standins on sys.path through the `slime_standin` fixture, or copy the
package with `slime_standin_writer` to write a variant)."""

STAND_IN = True  # the slime lane tells these stand-ins from slime's real source by this name
