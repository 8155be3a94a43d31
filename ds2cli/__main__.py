from ds2cli.cli import main

main()
