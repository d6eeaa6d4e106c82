"""Automatic search over recipes (issue 46, under way): the racing rule (`racing`) and the search space
(`space`). `llmopt search` itself, which drives them through the pipeline's build, evaluation and benchmark, is
not built yet."""
