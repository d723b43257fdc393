package dev.railyard.peer.omega;

import java.util.List;

/** Just enough JSON writing for the RESULT line (no JSON library in a plain Spring Boot app). */
final class Json {

  private Json() {}

  static String str(String s) {
    StringBuilder b = new StringBuilder("\"");
    for (int i = 0; i < s.length(); i++) {
      char c = s.charAt(i);
      if (c == '"' || c == '\\') {
        b.append('\\').append(c);
      } else if (c < 0x20) {
        b.append(String.format("\\u%04x", (int) c));
      } else {
        b.append(c);
      }
    }
    return b.append('"').toString();
  }

  static String strings(List<String> items) {
    StringBuilder b = new StringBuilder("[");
    for (int i = 0; i < items.size(); i++) {
      if (i > 0) {
        b.append(',');
      }
      b.append(str(items.get(i)));
    }
    return b.append(']').toString();
  }
}
