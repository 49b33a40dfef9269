from narwhal.cli.narwhal import main

raise SystemExit(main())
