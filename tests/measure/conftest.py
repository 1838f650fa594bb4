import pytest

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 600, "n_positions": 256}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
           "vocab_size": 512, "max_position_embeddings": 256}


@pytest.fixture
def llama():
    return dict(LLAMA)


@pytest.fixture
def gpt2():
    return dict(GPT2)


@pytest.fixture
def mixtral():
    return dict(MIXTRAL)
