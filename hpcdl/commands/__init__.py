"""The `hpcdl` command and its subcommands: the top layer, which nothing else imports.

    cli.py        `hpcdl <command>`: the dispatcher
    command.py    what every command needs under MPI: parse once, agree on errors, fail once
    units.py      sizes, bandwidths and times on the command line
    train/        `hpcdl train`: options, trainer, pacing, strategies registry, metrics, models, data
    bench/        `hpcdl bench`: the collective microbenchmark
    tune/         `hpcdl tune`: fit the cost model, write a tuning file, or --predict a cluster
    timing/       one collective at one size, timed and checked exactly (bench and tune)
    info.py       `hpcdl info`: the MPI and GPU environment as every rank sees it
    slurm.py      `hpcdl slurm render`: batch scripts from the templates
"""
