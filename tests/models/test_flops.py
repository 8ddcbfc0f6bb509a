"""Model FLOPs per token (MFU's numerator): 2 FLOPs per multiply-add of every weight matrix, plus attention's
score and value products, plus the SSD scan; x3 for training."""

from nvfp4_train.models.config import count_parameters, model_config
from nvfp4_train.models.flops import forward_flops_per_token, training_flops_per_token


def test_mlp_only_model_is_two_flops_per_weight():
    # no attention, no Mamba: every weight but the embedding and the norms is used once per token
    mc = model_config("tiny").replace(pattern="----", num_layers=4)
    h, v = mc.hidden_size, mc.vocab_size
    matmul_weights = count_parameters(mc) - v * h - 4 * h - h  # embedding, 4 pre-norms, final norm
    assert forward_flops_per_token(mc, 128) == 2.0 * matmul_weights
    assert training_flops_per_token(mc, 128) == 3.0 * forward_flops_per_token(mc, 128)


def test_attention_adds_scores_and_values_linear_in_sequence():
    mc = model_config("tiny").replace(pattern="*", num_layers=1)
    q = mc.num_attention_heads * mc.kv_channels
    assert forward_flops_per_token(mc, 256) - forward_flops_per_token(mc, 128) == 2 * 2 * 128 * q
