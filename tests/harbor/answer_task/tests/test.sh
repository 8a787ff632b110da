#!/bin/bash
# The reward is 1 when the agent left an answer in /app/answer.txt, else 0; the answer's
# length goes to reward.json beside it so a test can check what the verifier saw.
if [ -f /app/answer.txt ]; then
  printf '{"reward": 1, "answer_bytes": %d}\n' "$(wc -c < /app/answer.txt)" > /logs/verifier/reward.json
else
  echo '{"reward": 0, "answer_bytes": -1}' > /logs/verifier/reward.json
fi
