"""The MLflow pyfunc model of a registered variant (logged as model-from-code, so no pickles in the registry)."""

from pathlib import Path

import mlflow.models
import mlflow.pyfunc

from tasks.decide.registry import VARIANT_ARTIFACT


class LlmoptVariantModel(mlflow.pyfunc.PythonModel):
    """Loads the variant through the project Runtime; predict maps prompts to greedy completions."""

    def load_context(self, context):
        from tasks.engines import load_runtime

        self.runtime = load_runtime(Path(context.artifacts[VARIANT_ARTIFACT]), threads=2)

    def predict(self, context, model_input: list[str], params=None) -> list[str]:
        prompts = list(model_input)
        max_new_tokens = int((params or {}).get("max_new_tokens", 64))
        outputs = self.runtime.generate([self.runtime.encode(p) for p in prompts], max_new_tokens)
        return [self.runtime.decode(ids) for ids in outputs]


mlflow.models.set_model(LlmoptVariantModel())
