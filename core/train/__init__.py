"""Training EAGLE-1 heads for any Llama-family target: `python -m core.train <stage>`.

Stages (each resumable): prompts -> distill -> features -> train -> eval.
"""
