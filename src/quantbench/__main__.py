from quantbench.cli import main

raise SystemExit(main())
