from narwhal.cli.daemon import main

raise SystemExit(main())
