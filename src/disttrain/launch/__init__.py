"""Starting a job's workers: torch's elastic agent (:mod:`.agent`, behind ``disttrain
train`` and ``disttrain run``) and SLURM's ``srun`` tasks (:mod:`.slurm`)."""
