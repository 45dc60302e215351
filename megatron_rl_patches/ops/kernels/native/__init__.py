"""The invariant mode's CPU sums as a compiled C kernel, built with the system's C compiler at first
use and cached (:mod:`.build`); :class:`.backend.InvariantNative` runs it, the torch invariant tiles
being the fallback where no compiler is present."""
