"""The models a server answers to: its served names for the engine, and the LoRA adapters it serves as
models of their own (`--lora-modules`, vLLM's /v1/load_lora_adapter), each checked as it is added."""
import itertools
from typing import TYPE_CHECKING

from kiln.runtime.lora_request import LoRARequest
from kiln.serve.protocol import APIError, ModelCard, ModelList

if TYPE_CHECKING:  # the runtime imports torch: loaded with the engine, after the port answers
    from kiln.runtime.frontend.input_processor import InputProcessor


class ServedModels:
    def __init__(self, names: list[str], root: str, input_processor: "InputProcessor"):
        self.names, self.root = names, root
        self.input_processor = input_processor  # checks an adapter against the engine
        self.max_model_len = input_processor.info.max_model_len
        model = input_processor.info.model_config
        total, active = model.parameter_counts()
        self.metadata = dict(parameters=total, active_parameters=active, num_experts=model.moe.num_experts or None,
                             experts_per_token=model.moe.top_k or None)
        self.loras: dict[str, LoRARequest] = {}  # served adapter name -> its request
        self._lora_ids = itertools.count(1)

    def resolve(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """(the name a response answers with, the adapter that name serves or None); 404 if unknown."""
        if requested is None:
            return self.names[0], None
        if requested not in self.names and requested not in self.loras:
            raise APIError(404, f"The model `{requested}` does not exist. Served: "
                           f"{', '.join([*self.names, *self.loras])}", "model", "model_not_found")
        return requested, self.loras.get(requested)

    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter in `path` as model `name` (checked now: a bad one is a 400 naming
        lora_path, whatever the adapter reader named)."""
        if name in self.loras or name in self.names:
            raise APIError(400, f"The model `{name}` is already served", "lora_name")
        lora = LoRARequest(name, next(self._lora_ids), str(path))
        try:
            self.input_processor.check_lora(lora)
        except ValueError as e:
            raise APIError(400, str(e), "lora_path") from None
        self.loras[name] = lora

    def remove_lora(self, name: str) -> None:
        """Requests naming it from now on get 404; those running finish with it."""
        if self.loras.pop(name, None) is None:
            raise APIError(404, f"The LoRA adapter `{name}` is not served", "lora_name", "model_not_found")

    def model_list(self) -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=self.root, max_model_len=self.max_model_len, **self.metadata)
                               for name in self.names] + [
            ModelCard(id=name, root=lora.lora_path, parent=self.names[0], max_model_len=self.max_model_len,
                      **self.metadata) for name, lora in self.loras.items()])
