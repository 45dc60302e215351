from megatron_rl_patches.apps.cli import main

raise SystemExit(main())
