"""The MLflow pyfunc model of a registered variant, logged as model-from-code (no pickles in the registry).

It imports only `tasks.engines` (shipped with the model as code, see `model_registry.register_variant`), so a
registered version loads in any environment built from the model's own requirements, outside this checkout.
"""

from pathlib import Path

import mlflow.models
import mlflow.pyfunc

from tasks.config import TargetConfig
from tasks.engines import load_runtime
from tasks.engines.manifest import VARIANT_ARTIFACT

THREADS = 2  # engine threads when served by MLflow (llmopt's own server takes target.threads)


class LlmoptVariantModel(mlflow.pyfunc.PythonModel):
    """Loads the variant through its Runtime; predict maps prompts to greedy completions."""

    def load_context(self, context):
        self.runtime = load_runtime(Path(context.artifacts[VARIANT_ARTIFACT]), TargetConfig(threads=THREADS))

    # No type hints here: MLflow would derive a signature from them and drop the `params` of the logged one.
    def predict(self, context, model_input, params=None):
        max_new_tokens = int((params or {}).get("max_new_tokens", 64))
        prompts = [self.runtime.encode(prompt) for prompt in _prompts(model_input)]
        return [self.runtime.decode(ids) for ids in self.runtime.generate(prompts, max_new_tokens)]


def _prompts(model_input) -> list[str]:
    """Prompts from what the scoring server hands over: a one-column DataFrame, a Series or a list."""
    if hasattr(model_input, "columns"):
        model_input = model_input.iloc[:, 0]
    return [str(prompt) for prompt in model_input]


mlflow.models.set_model(LlmoptVariantModel())
