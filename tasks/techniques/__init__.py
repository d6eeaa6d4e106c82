"""The techniques a recipe's steps name, one module each, registered in tasks.techniques.registry; `build` runs
a recipe's steps on the base model and saves the variant."""
