from .api import add_adapter, trainable_parameters
from .export import export_hf_state_dict
from .peft_io import load_adapter, save_adapter
from .slots import (
    TRAIN_SLOT,
    AdapterLayer,
    AdapterState,
    adapter_layers,
    adapter_state,
    adapter_state_dict,
    allocate_slots,
    copy_into_slot,
    use_slot,
)

__all__ = [
    "TRAIN_SLOT", "AdapterLayer", "AdapterState", "add_adapter", "adapter_layers", "adapter_state",
    "adapter_state_dict", "allocate_slots", "copy_into_slot", "export_hf_state_dict", "load_adapter",
    "save_adapter", "trainable_parameters", "use_slot",
]
