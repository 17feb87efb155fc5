"""A swarm on this machine (``hivetrain local-swarm``, the chaos harness, tests): starting and stopping its
processes (``launcher``, ``forkserver``) and reading what they left (``summary``, ``agreement``)."""
