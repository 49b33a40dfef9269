from narwhal.cli.sim import main

raise SystemExit(main())
