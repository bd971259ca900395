"""The `hpcdl` command and its subcommands: the top layer, which nothing else imports. Each
parses and checks its command line and calls a library below (hpcdl/training/, hpcdl/tuning/,
hpcdl/benchmarking/).

    cli.py                  `hpcdl <command>`: the dispatcher
    collective_command.py   what every command needs under MPI: parse once, agree on errors, fail once
    units.py                sizes, bandwidths and times on the command line
    train.py                `hpcdl train`: the options into a TrainConfig, then the training library
    bench/                  `hpcdl bench`: the collective microbenchmark
    tune.py                 `hpcdl tune`: fit the cost model, write a tuning file, or --predict a cluster
    info.py                 `hpcdl info`: the MPI and GPU environment as every rank sees it
    slurm.py                `hpcdl slurm render`: batch scripts from the templates
"""
