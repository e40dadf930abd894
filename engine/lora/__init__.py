"""Multi-LoRA serving: PEFT adapters over one base model, rows of different adapters in one step.

adapter.py reads and checks a PEFT folder (expert_adapter.py its routed-expert parameters); ops.py
is the batched LoRA product; slots.py the bounded pool of adapters resident in the model's LoRA
weights; linear.py the projection wrapper that adds each row's adapter delta to the base output
(experts.py the same for a MoE layer's routed experts); resolver.py maps an adapter name to its
folder for loading on demand.
"""
