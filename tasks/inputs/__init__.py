"""Inputs: the base model folder and the validated corpus splits every variant is built and measured on."""
