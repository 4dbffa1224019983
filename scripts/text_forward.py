"""What the Python-side scripts share: the module that computes a checkpoint's logits on text.

transformers 5.24's Llama4ForConditionalGeneration.forward fails on every call (it reads
`image_outputs` off its language model's output), text alone included; its language model
(`language_model`, a Llama4ForCausalLM) computes what the wrapper would on text rows.
"""


def on_text(model):
    """`model`, or the language model of a wrapper whose own forward cannot run on text."""
    if type(model).__name__ == "Llama4ForConditionalGeneration":
        return model.language_model
    return model
