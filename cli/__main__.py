from legorl.cli.app import main

main()
