from podmeter.cli.main import main

raise SystemExit(main())
