"""What the verbs run, as library calls: ``train(recipe)`` (a recipe to a finished run folder) and ``plan(recipe)``
(what a run will need: memory, data, steps, schedule), for the command line, notebooks and the search."""
