from megatron_rl_patches.cli import main

raise SystemExit(main())
