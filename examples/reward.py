"""A reward: `coordinator start --task dataset --dataset gsm8k-sample --prompt-key question --reward
examples.reward:exact_and_brief`."""


def exact_and_brief(prompt: str, completion: str, answer: str) -> float:
    """1 when the completion's last number is the answer, less 0.1 per started 100 characters."""
    words = completion.replace(",", "").replace("$", "").split()
    numbers = [w.strip(".") for w in words if w.strip(".").lstrip("-").isdigit()]
    if not numbers or numbers[-1] != answer.split("####")[-1].strip():
        return 0.0
    return max(0.0, 1.0 - 0.1 * (len(completion) // 100))
