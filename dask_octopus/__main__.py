from dask_octopus.cli import main

main()
