from driftcheck.cli import main

main()
